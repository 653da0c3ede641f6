"""Gradient-based unlearning baselines (GA, GradDiff, NPO, SimNPO, IdkDPO) with retention-first composition."""
