"""The offline builders of the tiny random-weight models (``omni-make-model``): each writes an ordinary
HF or diffusers directory that the real loading code reads, weights a pure function of the seed."""
