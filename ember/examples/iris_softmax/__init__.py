"""A tiny python-runtime example: softmax regression over the four Iris flower measurements."""
