"""graphfl.server"""
