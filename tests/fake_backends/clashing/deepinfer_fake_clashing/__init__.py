"""Test fakes that claim names or aliases held by other backends."""
