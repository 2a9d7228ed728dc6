"""What the planner decides: pure Python over dataclasses, no torch and no torch.distributed."""
