"""The shipped configs, installed with moe_rl as package data (``moe_rl.configs``); see
:mod:`moe_rl.config.shipped`."""
