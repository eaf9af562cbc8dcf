//! SQLite backend. (Implementation pending.)
