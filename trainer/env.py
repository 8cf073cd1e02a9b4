"""The names every process of a job passes to the next, in one place: environment variables and exit codes.

Imports nothing, so any process — the pipeline's steps, a node's launcher, the rendezvous store, a rank —
can read them without paying for the rest of the trainer. Who sets each one is said beside it.
"""

# -- set by torchrun / ft_launcher (torch.distributed.elastic) for each worker ------------------------------
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # restarts of this node's workers by its launcher
TORCHELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # the elastic run: set only under a launcher
NODE_RANK_ENV = "PET_NODE_RANK"  # which node this is (Kubeflow Trainer's torch runtime; the local runner too)
# the node's index in the whole job where replica groups each number their nodes from 0 (set with the group)
NODE_INDEX_ENV = "RESILIENT_TRAIN_NODE_INDEX"
# how many times this node index was replaced in this launch (the local runner; 0 or unset: the node's first)
NODE_REPLACEMENT_ENV = "RESILIENT_TRAIN_NODE_REPLACEMENT"
# the node's fencing generation: bumped by every launcher that starts as this node index (trainer.run.lease)
NODE_GENERATION_ENV = "RESILIENT_TRAIN_NODE_GENERATION"
NUM_NODES_ENV = "PET_NNODES"  # how many nodes (the same runtime's; the local runner too)
FT_RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by NVRx's ft_launcher for each worker it monitors

# -- set by the train step for every process of one launch (components/train) ----------------------------
LAUNCHER_ENV = "RESILIENT_TRAIN_LAUNCHER"  # resilience.launcher: ft_launcher or torchrun
JOB_ATTEMPT_ENV = "RESILIENT_TRAIN_JOB_ATTEMPT"  # the job relaunch layer's attempt
GENERATION_ENV = "RESILIENT_TRAIN_LEASE_GENERATION"  # the launch's generation of the run folder's lease
BUDGET_SINCE_ENV = "RESILIENT_TRAIN_BUDGET_SINCE"  # its launch's start (epoch seconds): the run's start too
JOB_TOKEN_ENV = "RESILIENT_TRAIN_JOB_TOKEN"  # inherited by every process of one launch
RUN_DIR_ENV = "RESILIENT_TRAIN_RUN_DIR"  # and the run folder it trains into (ps e, debugging, tests)
REPLICA_GROUP_ENV = "RESILIENT_TRAIN_REPLICA_GROUP"  # the replica group of a node's processes (R >= 2)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's: the lighthouse's address, read by each group's rank 0
RENDEZVOUS_NODES_ENV = "RESILIENT_TRAIN_RENDEZVOUS_NODES"  # --nodes, set by the TrainJob on the rendezvous pod

# -- set by a node's launcher (trainer.launch.launcher) for every process of its node ---------------------
# The launcher's pid, and a token shared by every process it starts (workers in sessions of their own, rank
# monitors, the fork server).
NODE_LAUNCHER_PID_ENV = "RESILIENT_TRAIN_NODE_LAUNCHER_PID"
NODE_TOKEN_ENV = "RESILIENT_TRAIN_NODE_TOKEN"
NODE_STORE_ENV = "RESILIENT_TRAIN_NODE_STORE"  # the launch's node-memory folder
WARM_START_ENV = "RESILIENT_TRAIN_FORK_SERVER"  # the fork server's socket (trainer.launch.warm_start)
WARM_START_PID_ENV = "RESILIENT_TRAIN_FORK_SERVER_PID"  # and its process: a worker waits for it while it lives

# -- set by the fork server for the worker it forks ------------------------------------------------------
WORKER_STARTED_ENV = "RESILIENT_TRAIN_WORKER_STARTED_AT"  # the client's start, for its child's recovery figures

# -- set by the trainer itself -----------------------------------------------------------------------------
IN_PROCESS_ITERATION_ENV = "RESILIENT_TRAIN_IN_PROCESS_ITERATION"  # NVRx in-process restart's iteration

# -- set by Kubeflow Trainer on a TrainJob's pods (its progress endpoint: trainer.observe.progress) ---------
TRAINER_SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
TRAINER_SERVER_CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TRAINER_SERVER_TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"

# -- exit codes: what a process's end tells the layer above it ---------------------------------------------
# The restart budget gave up (a crash loop): fail the job, never relaunch (trainer.resilience.budget).
CRASH_LOOP_EXIT_CODE = 42
# A survivor's rendezvous waited resilience.replacement_timeout_seconds for a replacement that never came:
# restart the whole job (trainer.launch.node_lifecycle).
REPLACEMENT_TIMEOUT_EXIT_CODE = 43
# The node is not fit to train (trainer.resilience.health): replace it.
NODE_UNHEALTHY_EXIT_CODE = 44
# With replica groups, what 43 becomes: a survivor of one group waited in vain for a replacement; that group
# restarts (locally: its nodes; on EKS: each of its pods is replaced by index), the other groups train on.
GROUP_RESTART_EXIT_CODE = 45
# The node could not reach the rendezvous store for resilience.store_timeout_seconds (cut off from the job's
# network): it stopped its workers; replace it (the default verdict, locally and on EKS).
NODE_CUT_OFF_EXIT_CODE = 46
# A newer launcher of the same node index started (the node was replaced while this one was cut off): this one
# stopped without writing anything more; nothing to replace (trainer.run.lease.NodeFence).
NODE_FENCED_EXIT_CODE = 47
# timeout(1)'s code: a start-up phase hung (trainer.resilience.phases), restarted like any worker failure.
HANG_EXIT_CODE = 124
