"""Task sources (domains) and the task sampler process."""
