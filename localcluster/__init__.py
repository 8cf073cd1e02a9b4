"""A training job's processes on this machine, for the local runner (components/train/local.py) and the tests:
one launcher with every rank (processes.py: their environment, their output, how they are stopped, what an exit
means), or a launcher per emulated node (nodes.py) with a network of its own (network.py: loopback, or a network
namespace per node) and the network drills that cut it (network_drills.py). On EKS the nodes are pods of a
TrainJob and none of this runs (components/train/trainjob.py)."""
