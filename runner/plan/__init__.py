"""The planner: what a configuration moves per step and what that costs (α–β model)."""
