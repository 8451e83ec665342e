"""The replica optimizers: synchronous SGD and any torch.optim class run synchronously, the EASGD
family, and SC17's asynchronous parameter-server baselines on one-sided windows."""
