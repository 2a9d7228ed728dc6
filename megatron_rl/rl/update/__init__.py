"""The weight update of a GRPO step: the loss and advantages (`grpo.py`), log-prob recompute and the
policy update over minibatches and micro-batches (`policy_update.py`), the expert-parallel training
step's pieces (`train_step.py`), the training-inference mismatch (`mismatch.py`) and the update's
own figures (`stats.py`)."""
