"""Datasets read from files: token streams, text with a tokenizer, image folders; the row-source
contract they keep (`rows`) and the background reader that reads a step's rows ahead
(`readahead`)."""
