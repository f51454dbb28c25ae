"""Advice that two stages give in the same words, kept outside both (a stage never imports a later one's
code: editing the report must not retrain): what a run that does not learn most likely needs, said by
training's early warnings on the console (rectrain.train.early_warning) and by the report's learning
findings (rectrain.report.learning)."""

MORE_STEPS_FIX = (
    "Give it more optimizer steps: a smaller train.batch_size on a small dataset, more train.epochs; check "
    "train.lr (it is for a global batch of 256 and scales with it by train.lr_scaling) and that the train and val splits hold the "
    "same classes."
)
