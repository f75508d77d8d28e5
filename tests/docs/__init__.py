"""Tests of the README: its commands and examples run as written."""
