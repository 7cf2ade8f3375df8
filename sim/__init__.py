"""Multi-process simulator: fake trainers publishing weights to a receiving weight manager."""
