"""Corpora and tokenisation: the synthetic language, text and token files, the token cache, the
global batch of step k. Imports core and config only.
"""
