"""The GPT the strategies know how to split (`gpt`), its tensor parallelism over the model group
and its context parallelism (the sequence split over the ranks).
"""
