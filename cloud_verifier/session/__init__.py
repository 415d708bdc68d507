"""The sessions of one replica: the session table, a session's state, admission and resume, validation of what edges send, a session's grammar."""
