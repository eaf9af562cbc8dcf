//! Reading the name a connection asks for from its first bytes.
