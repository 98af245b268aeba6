"""graphfl.common"""
