"""ft_launcher or torchrun, run in this process so that nothing it starts outlives it.

    python -m trainer.launcher ft_launcher --max-restarts=3 ... --nproc-per-node=2 -m trainer ...
    python -m trainer.launcher torchrun --max-restarts=3 ... -m trainer ...

What the pipeline's train step runs on one machine. The launcher watches the step that started it, and
every helper it forks (ft_launcher's rank monitor servers) watches the launcher; the workers watch it from
their side (trainer.__main__). So killing the step, or the launcher, stops the whole job.
"""

import runpy
import sys

from trainer.nvrx_compat import FT_LAUNCHER_MODULE
from trainer.parent_watch import forked_children_die_with_this_process, watch_parent

LAUNCHERS = {"ft_launcher": FT_LAUNCHER_MODULE, "torchrun": "torch.distributed.run"}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in LAUNCHERS:
        sys.exit(f"usage: python -m trainer.launcher {{{'|'.join(LAUNCHERS)}}} LAUNCHER-ARGS...")
    module = LAUNCHERS[sys.argv[1]]
    watch_parent()
    forked_children_die_with_this_process()
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
