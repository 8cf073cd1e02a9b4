"""ft_launcher or torchrun, run in this process so that nothing it starts outlives it.

    python -m trainer.launcher ft_launcher --max-restarts=3 ... --nproc-per-node=2 -m trainer ...
    python -m trainer.launcher torchrun --max-restarts=3 ... -m trainer ...

What the pipeline's train step runs on one machine and a TrainJob runs on each node. The launcher watches
the process that started it, and every helper it forks (ft_launcher's rank monitor servers) watches the
launcher; the workers watch it from their side (trainer.__main__). So killing the step, or the launcher,
stops the whole job. Version- and node-dependent flags are settled here, where NVRx is installed
(trainer.resilience.nvrx_compat.runtime_launcher_args).
"""

import os
import runpy
import sys

from trainer.resilience.nvrx_compat import FT_LAUNCHER_MODULE, runtime_launcher_args
from trainer.parent_watch import forked_children_die_with_this_process, watch_parent

LAUNCHERS = {"ft_launcher": FT_LAUNCHER_MODULE, "torchrun": "torch.distributed.run"}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in LAUNCHERS:
        sys.exit(f"usage: python -m trainer.launcher {{{'|'.join(LAUNCHERS)}}} LAUNCHER-ARGS...")
    launcher, module = sys.argv[1], LAUNCHERS[sys.argv[1]]
    watch_parent()
    forked_children_die_with_this_process()
    sys.argv = [module, *runtime_launcher_args(launcher, sys.argv[2:], dict(os.environ))]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
