"""`trainplan calibrate`: refit the cpu profile's step time, the loss law and the bits penalties from recorded runs."""
