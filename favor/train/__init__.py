"""Training: the step functions (steps.py) that the loop (favor.trainer) and its stages run."""
