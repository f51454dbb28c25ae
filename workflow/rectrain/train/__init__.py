"""DDP training from the packed .rec: launch, the training run, memory preflight, checkpoints, telemetry,
multi-node rendezvous and the node-local copy.  `python -m rectrain.train` runs rectrain.train.trainer."""
