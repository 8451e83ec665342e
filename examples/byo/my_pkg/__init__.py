"""A user's own code, as gridrun runs it: README, "Your own model, data and optimizer"."""
