"""Process groups, launching and the expert-parallel token dispatcher (the CPU/gloo path)."""
