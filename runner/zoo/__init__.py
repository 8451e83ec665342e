"""The model zoo and the datasets: registered plugins, the text corpus, and a user's dataset named
by _target_."""
