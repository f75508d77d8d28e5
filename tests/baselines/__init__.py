"""Tests against learn2learn, higher and TorchOpt (marked ``baselines``), and of the marker."""
