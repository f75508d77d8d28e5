"""Tests of metalearn.runs: recipes, records, tracking, locks, resumes, the outer loop."""
