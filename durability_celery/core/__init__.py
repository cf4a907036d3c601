# The pure allocation core: state and messages in, decisions out.
# Rule: nothing here imports anything but the standard library, `errors` and the
# wire format (`wire`), reads a clock or draws a random number; `now` and new ids
# are always parameters.
