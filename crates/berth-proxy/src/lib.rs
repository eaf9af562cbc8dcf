//! berth's reverse proxy. (Implementation pending.)
