"""`python -m rectrain.train`: the training module (rectrain.train.trainer), launcher-proof."""

import sys

from rectrain.train.trainer import main

if __name__ == "__main__":
    sys.exit(main())
