"""The cost model: what a step's compute and communication take on a machine (α–β costs of the
collectives, compute rates of layers and operators), used by the strategies' predictions, the
planner and a run's summary. Prices only: it moves no data (the core does) and knows no strategy.
"""
