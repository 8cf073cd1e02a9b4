"""What a user runs: the command line, the KFP pipeline, the local runner and its console, KFP submission."""
