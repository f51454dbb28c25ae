"""`python -m rectrain.train`: the training module (rectrain.train.trainer), launcher-proof."""

from rectrain.train.trainer import main

if __name__ == "__main__":
    main()
