"""What runs around each call of a parallelized module: a program per mode, and the guards
that turn misuse that would hang or compute something else into an error."""
