"""`trainplan calibrate`: refit the cpu profile's step time, an accelerator's profile, the loss law and the
bits penalties from recorded runs."""
