"""`python -m rectrain.train`: the training module (rectrain.train.trainer), launcher-proof."""

import gc
import os
import signal
import sys


def _interrupted_while_importing(signum, frame) -> None:
    # Importing torch and the training code takes seconds (tens on a busy machine): a Ctrl-C then would
    # print an import traceback from every rank. Nothing of this launch exists yet, so one line instead.
    sys.stderr.write(
        "[train] interrupted while starting: nothing new saved (checkpoints/ as it was); rerun to start or resume\n"
    )
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_importing)
    from rectrain import cli
    from rectrain.train import direct

    main = direct.main
    if not direct.relaunches(sys.argv[1:]):  # a rank or a single process trains here: torch now
        # Importing torch, torch._dynamo (torchvision's ops import it) and DALI creates about a million
        # objects, and the collections they set off cost ~0.5 CPU-s of the ~2.7 (bench/RESULTS.md): none
        # while importing; frozen after, so the run's own collections skip them.
        gc.disable()
        from torch.distributed.elastic.multiprocessing.errors import record

        import rectrain.train.trainer  # noqa: F401  (imported under the handler above, not at the first step)

        gc.freeze()
        gc.enable()
        main = record(direct.main)  # torchrun reads the error file it writes for a failed rank
    # from here a KeyboardInterrupt is the trainer's, and training's stop handling replaces it (train.stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cli.end(main())
