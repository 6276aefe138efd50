"""Side-by-side benchmarks against peers and limits (`make bench`)."""
