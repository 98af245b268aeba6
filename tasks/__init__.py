"""Tasks: datasets, Dirichlet partitions, models and client graphs (no Flower, no gRPC)."""
