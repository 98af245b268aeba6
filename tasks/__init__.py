"""graphfl.tasks"""
