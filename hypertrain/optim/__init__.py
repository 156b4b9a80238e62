"""The inner optimizers (AdamW, Muon) and their schedule, written once for a leading replica axis."""
