"""What runs in a node's launcher process, before and around the workers: the launcher (launcher.py), its
command (command.py), the node's fork server (warm_start.py), the rendezvous store outside every node
(rendezvous_store.py), what a node's end means (node_lifecycle.py), whether a node is fit (node_health.py),
and dying with the parent (parent_watch.py). No module-level torch import: a node starts fast."""
