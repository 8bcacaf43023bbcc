"""Training: the optimizer and state, the compiled step, the loop, and the loop's infrastructure."""
