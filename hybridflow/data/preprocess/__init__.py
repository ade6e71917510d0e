"""Scripts that turn public datasets into RLHFDataset rows (`python -m hybridflow.data.preprocess.<name>`)."""
