"""Weights in and out: pretrained files read per rank, trained models written for other tools."""
