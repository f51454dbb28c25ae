"""Reading a run's TensorBoard curves back with TensorBoard's own event reader (rectrain.train.curves)."""

# The tags a CPU run writes (no GPU, no fp16 loss scale); the data-wait share per epoch is per rank.
PER_LINE = {"train/loss", "train/lr", "train/images_per_s", "train/data_wait_share/rank0", "train/resolution_px"}
PER_EPOCH = {
    f"epoch/{t}" for t in ("train_loss", "val_single_view_top1", "val_single_view_top5", "seconds", "cpu_busy_percent")
} | {"epoch/iowait_percent", "epoch/data_wait_share/rank0", "epoch/data_wait_share/rank1"}
# Rank 1's share per line, read from its live step log: a point only where it had logged new steps.
PER_LINE_PEERS = {"train/data_wait_share/rank1"}


def scalar_steps(folder) -> dict[str, list[int]]:
    """Every scalar tag of the event files directly in `folder` (all processes' files together, as
    TensorBoard shows them) -> its steps in the order read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_curves_continue(folder, steps_per_epoch, epochs, stopped_after=None, every_step=True):
    """The two processes of a stopped and resumed run: every CPU tag present, each tag's steps strictly
    increasing (none written twice), per-epoch tags at each epoch's last step, progress-line tags only at
    steps the run took (not a pass's first: no steady step yet).  With `every_step` (a progress line a
    step) every such step is there, except perhaps the stopped process's last (`stopped_after`): it has
    a point only when the next step's poll came before the stop (losses are read one step late)."""
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2, "one event file per process"
    steps = scalar_steps(folder)
    assert PER_LINE | PER_LINE_PEERS | PER_EPOCH <= set(steps), sorted(steps)
    for tag, got in steps.items():
        assert got == sorted(set(got)), f"{tag}: {got}"
    last = steps_per_epoch * epochs
    expected = {s for s in range(1, last + 1) if s % steps_per_epoch != 1}
    for tag in PER_LINE:
        got = set(steps[tag])
        assert got and got <= expected, (tag, steps[tag])
        if every_step:
            assert expected - got <= {stopped_after}, (tag, steps[tag])
    for tag in PER_LINE_PEERS:
        assert set(steps[tag]) <= expected, (tag, steps[tag])
    for tag in PER_EPOCH:
        assert steps[tag] == [steps_per_epoch * (e + 1) for e in range(epochs)], (tag, steps[tag])
