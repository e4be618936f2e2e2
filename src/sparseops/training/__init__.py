"""``sparseops train``'s machinery: the data (data.py), DCP checkpoints with resume (checkpoint.py), faults
(faults.py) and the training loop (loop.py); docs/training.md."""
