"""Building blocks shared by the model files: norm, rotary, attention, activation, linear."""
