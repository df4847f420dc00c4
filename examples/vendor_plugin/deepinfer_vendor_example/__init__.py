"""An example DeepInfer backend package (see README.md). Importing it imports nothing heavy."""
