"""Prediction beside measurement: the comparison table, its verdicts, the report's frames, figures and HTML pages."""
