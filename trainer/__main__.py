import sys

from trainer.train import main

# The guard matters: DCP's process-based async saver and NVRx's workers start with `spawn`.
if __name__ == "__main__":
    sys.exit(main())
