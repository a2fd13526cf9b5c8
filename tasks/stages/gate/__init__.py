"""The nightly gate: challenger vs champion measured on one server setting (`nightly`), decided on the confidence bound of the gain (`noise`)."""
