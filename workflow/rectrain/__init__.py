"""rectrain: raw ImageNet -> MXNet RecordIO on fast storage -> DDP training fed by DALI -> report."""

__version__ = "0.1.0"
